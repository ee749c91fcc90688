"""``python -m mentorrl.cli`` (and ``torchrun -m mentorrl.cli``): the ``mentorrl`` command."""

from mentorrl.cli import app

app()
