"""mentorrl: post-training for language-model agents."""

__version__ = "0.1.0"
