"""The vLLM worker extension that loads the learner's weights (runs inside vLLM's worker).

vLLM mixes this class into its worker (``LLM(worker_extension_cls=...)``); the backend calls
``llm.collective_rpc("mentorrl_load_weights", args=(path,))`` with a safetensors file of the
policy's state dict. The method reloads the weights in place through vLLM's own loader (which
repacks them for the CPU kernels), then re-ties the output layer to the input embedding when the
model ties them: the in-place reload alone leaves the output layer with the old weights.
Imports nothing from vLLM at module level, so mentorrl imports without it.
"""

from __future__ import annotations

import torch


class WeightSyncExtension:
    def mentorrl_load_weights(self, path: str) -> int:
        """Load the safetensors file ``path`` (a Hugging Face state dict); returns the tensors read."""
        from safetensors.torch import load_file

        state = load_file(path)
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        retie(model, state)
        return len(state)

    def mentorrl_lm_head(self) -> torch.Tensor:
        """The output layer's weight as the engine uses it (for tests)."""
        model = self.model_runner.get_model()
        return model.lm_head.weight.detach().float().cpu().clone()

    def mentorrl_embedding(self) -> torch.Tensor:
        model = self.model_runner.get_model()
        return model.model.embed_tokens.weight.detach().float().cpu().clone()


@torch.no_grad()
def retie(model, state: dict[str, torch.Tensor]) -> None:
    """With tied embeddings, make the output layer use the (new) input embedding again.

    The in-place reload gives the embedding new weights, but the output layer keeps what it was
    built with: the old tensor, and on CPU the kernel's own packed copy of it (a closure made
    when the model was loaded). Point it at the embedding's weight and let its quantisation
    method process (repack) it again."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    head, emb = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or emb is None or not hasattr(head, "weight"):
        return
    head.weight = emb.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
