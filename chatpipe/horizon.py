"""The training horizon nanochat derives before its first step: total batch, steps, LR scale, weight decay.

Formulas (``shared/reference/nanochat/README.md``, "Training-horizon derivation"), for a model with
N scaling parameters (block matrices + lm_head, :meth:`chatpipe.model.gpt.GPT.scaling_params`):

- reference: the same recipe at depth 12, trained to ``D_ref = ratio * N(d12)`` tokens with
  ``B_ref = 2**19`` tokens per step (both measured by nanochat);
- tokens ``D = ratio * N``; batch (when automatic) ``B = 2**round(log2(B_ref * (D / D_ref)**0.383))``
  (the Power Lines fit of the optimal batch);
- every AdamW and Muon learning rate times ``sqrt(B / B_ref)``;
- weight decay ``wd * sqrt(B / B_ref) * D_ref / D`` (keeps the decay's time constant a fixed share
  of the run; nanochat's ``wd`` is 0.28);
- steps: given, else ``round(target_flops / (flops_per_token * B))``, else ``D // B``.

Pure arithmetic on counts: :func:`chatpipe.train.pretrain_plan.plan_counts` counts the models once (on the
meta device) and :func:`chatpipe.train.pretrain_plan.horizon_for` feeds those counts to this.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

REFERENCE_DEPTH = 12  # nanochat tuned its batch and weight decay at d12
REFERENCE_BATCH = 1 << 19  # B_ref: the best total batch at d12, 524,288 tokens
BATCH_EXPONENT = 0.383  # Power Lines: the optimal batch grows as D**0.383
NANOCHAT_WEIGHT_DECAY = 0.28  # nanochat's default, tuned at the reference


@dataclass(frozen=True)
class Horizon:
    """What a pretraining run trains for, and the LR and weight-decay adjustments that go with it."""

    scaling_params: int  # N
    reference_params: int  # N at depth 12
    flops_per_token: int
    target_tokens: int  # int(ratio * N); negative when the ratio is off (-1) and target_flops rules
    total_batch_size: int  # B, tokens per optimizer step over all ranks
    num_iterations: int  # optimizer steps
    batch_lr_scale: float  # sqrt(B / B_ref); multiplies the LRs where lr_scaling is on
    lr_scaled: bool
    weight_decay: float  # the weight decay the run uses (scaled where wd_scaling is on)

    def as_params(self) -> dict[str, float | int | bool]:
        """Flat name -> value, for logs and MLflow params."""
        return asdict(self)


def power_lines_batch(tokens: float, reference_tokens: float) -> int:
    """Total batch (tokens per step, a power of two) for a run of ``tokens``, from the d12 reference's.

    With the ratio off (-1) both token counts are negative; their quotient is N / N(d12), as in nanochat.
    """
    ideal = REFERENCE_BATCH * (tokens / reference_tokens) ** BATCH_EXPONENT
    return 2 ** round(math.log2(ideal))


def derive_horizon(
    *,
    scaling_params: int,
    reference_params: int,
    flops_per_token: int,
    ratio: float,
    total_batch_size: int = -1,
    num_iterations: int = -1,
    target_flops: float = -1.0,
    weight_decay: float = NANOCHAT_WEIGHT_DECAY,
    lr_scaling: bool = True,
    wd_scaling: bool = True,
) -> Horizon:
    """Resolve a run's horizon; -1 means "derive it" for ``total_batch_size``, ``num_iterations`` and
    ``target_flops`` (off). ``ratio`` may be -1 only when ``num_iterations`` or ``target_flops`` sets the
    length. ``lr_scaling``/``wd_scaling`` off leave the LRs (scale still reported) and the weight decay as given.
    """
    if ratio <= 0 and num_iterations <= 0 and target_flops <= 0:
        raise ValueError(
            f"target_param_data_ratio = {ratio} needs target_flops > 0 or max_steps > 0 to set the run's length"
        )
    target_tokens = int(ratio * scaling_params)
    reference_tokens = ratio * reference_params
    batch = total_batch_size if total_batch_size > 0 else power_lines_batch(target_tokens, reference_tokens)
    # nanochat leaves the scale at exactly 1.0 at the reference batch; sqrt(1.0) is 1.0 anyway
    lr_scale = math.sqrt(batch / REFERENCE_BATCH)
    if wd_scaling:
        weight_decay = weight_decay * math.sqrt(batch / REFERENCE_BATCH) * (reference_tokens / target_tokens)
    if num_iterations > 0:
        steps = num_iterations
    elif target_flops > 0:
        steps = round(target_flops / (flops_per_token * batch))
    else:
        steps = target_tokens // batch
    return Horizon(
        scaling_params=scaling_params,
        reference_params=reference_params,
        flops_per_token=flops_per_token,
        target_tokens=target_tokens,
        total_batch_size=batch,
        num_iterations=steps,
        batch_lr_scale=lr_scale,
        lr_scaled=lr_scaling,
        weight_decay=weight_decay,
    )
