"""Multi-token-prediction (MTP) layers trained beside the policy: the ``num_nextn_predict_layers`` DeepSeek-V3/V3.2,
Kimi-K2 and GLM-4.5 store after their last layer, which engines draft with (speculative decoding).

MTP layer k, at position t, joins the previous depth's hidden state there (the main model's final, normed, hidden
state for the first) with the embedding of token t + k (``eh_proj`` over ``[enorm(embedding); hnorm(hidden)]``), runs
a decoder layer over the sequence and predicts token t + k + 1 through its norm and the model's output layer.

Choices:

* ``train.objective.mtp_loss_coef`` (default 0): at 0 the layers stay as loaded: not built, not pushed, and written
  back unchanged by export (`rlx.train.spec.ModelSpec.carried`), as slime leaves them unless asked. Above 0 they are
  megatron's own layers (`MultiTokenPredictionBlock`) on the model of the last stage, trained with the cross entropy
  of the response tokens they predict, each token weighted as the policy loss weights it, averaged over depths, times
  the coefficient (megatron's and slime's ``mtp_loss_scaling_factor``, 0.2 in their examples); they are pushed with
  the rest under the checkpoint's names, so that an engine's draft follows the policy.
* Detached: the MTP loss trains the MTP layers only. Their inputs (the main model's hidden states and the token
  embeddings) and the output layer's weight are detached, so the policy's gradient is the RL objective's alone
  (NeMo RL's ``mtp_detach_heads``): without gradient clipping a run trains the same policy whether or not its MTP
  layers train (tested). With it (``train.optim.clip_grad``, 1 by default) the global norm counts the MTP layers'
  gradients too, as megatron's does, so a large MTP gradient makes the clip shrink the policy's step as well.
* Only predictions of response tokens count, from positions of the same sample: nothing crosses packed samples.
* Run from a hook on the decoder's output, in training forwards only (log-prob passes skip them), not through
  megatron's GPTModel MTP path, which in megatron 0.16 needs labels and then returns a loss instead of the logits the
  RL step needs. One pipeline stage: the layers need the word embeddings, which only the first stage holds.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from rlx.errors import RLXError

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rlx.train.packing import PackedBatch


def attach(model: Any, config: TransformerConfig, layer_spec: ModuleSpec, layers: int) -> None:  # (a GPTModel)
    """Build `layers` MTP layers around the decoder layer `layer_spec` as ``model.mtp``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not (model.pre_process and model.post_process):
        raise RLXError("train.parallel.pp: multi-token-prediction layers train with one pipeline stage (they need the "
                       "word embeddings of the first stage and the output layer of the last); set pp to 1 or "
                       "train.objective.mtp_loss_coef to 0")
    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=WrappedTorchNorm, hnorm=WrappedTorchNorm, eh_proj=ColumnParallelLinear, transformer_layer=layer_spec,
        layer_norm=WrappedTorchNorm))
    config = copy.copy(config)  # (the block's own: the GPTModel's keeps mtp_num_layers unset, its MTP path off)
    config.mtp_num_layers = layers
    model.mtp = MultiTokenPredictionBlock(config, MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * layers))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log p(target)`` per row of ``[T, V]`` logits, the vocabulary split over tensor-parallel ranks or not."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    return -tensor_parallel.vocab_parallel_cross_entropy(logits[:, None, :].clone(), targets[:, None])[:, 0]


class MTPTraining:
    """The attached MTP layers of a trained model, run after its decoder while `batch` is set (a training forward of
    that micro-batch): ``batch.mtp_logprobs`` becomes the ``[depths, T]`` log-probs they give its response tokens (0
    where the predicting position would lie before the sample's start)."""

    def __init__(self, model: Any):  # (a GPTModel with `attach`'s layers)
        self.model = model
        self.depths = len(model.mtp.layers)
        self.batch: tuple[PackedBatch, torch.Tensor, torch.Tensor] | None = None  # (batch, input ids, positions)
        model.decoder.register_forward_hook(self._after_decoder, with_kwargs=True)

    def _after_decoder(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       hidden: torch.Tensor) -> None:
        if self.batch is None:
            return
        mb, ids, positions = self.batch
        m = self.model

        def embedding(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            return m.embedding(input_ids=input_ids, position_ids=position_ids).detach()

        states = m.mtp(input_ids=ids, position_ids=positions, hidden_states=hidden.detach(),
                       attention_mask=kwargs.get("attention_mask"), rotary_pos_emb=kwargs.get("rotary_pos_emb"),
                       rotary_pos_cos=kwargs.get("rotary_pos_cos"), rotary_pos_sin=kwargs.get("rotary_pos_sin"),
                       embedding=embedding)
        weight = (m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights
                  else m.output_layer.weight).detach()
        dev, width = hidden.device, ids.shape[1]
        resp = mb.response_positions.to(dev)
        place = mb.position_ids.to(dev).flatten()[resp]  # the main prediction's position within its sample
        targets = mb.targets.to(dev)[resp]
        out = []
        for d, h in enumerate(states.chunk(1 + self.depths, dim=0)[1:], start=1):
            at = (resp - d).clamp_min(0)  # depth d predicts the token main predicts at resp from d positions before
            # `forward`, not the module call: the output layer's hook keeps the main prediction's positions
            logits, _ = m.output_layer.forward(h[at % width, at // width].unsqueeze(1), weight=weight)
            out.append(torch.where(place >= d, token_logprobs(logits[:, 0].float(), targets), 0.0))
        mb.mtp_logprobs = torch.stack(out)
