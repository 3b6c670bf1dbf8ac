"""Ratio statistics of an asynchronous run, bucketed by each sample's staleness k (weight syncs between the policy
that sampled it and the trainer's): `ratio/staleness/<k>/<stat>` (the stats: `metric_keys.STALENESS_STATS`).

For each trained token of a step: the coupled ratio new/behaviour (TRL's `AsyncGRPOTrainer` clips it), the decoupled
ratio new/proximal and the importance ratio proximal/behaviour (`grpo_ratio.corrections.decoupled`), whether PPO's
clip is active under each, and the IS weight applied. Sums live in one (K + 1, F) fp64 tensor on the loss's device:
no host read until the step is logged, one all-reduce then (fixed shape on every process).
"""

from __future__ import annotations

import torch

from .metric_keys import STALENESS_STATS, staleness_key
from .ratios import ppo_clip_active


# the columns of the accumulator, in order
_COLUMNS = ("tokens", "new_behav_oob", "new_behav_clip", "new_behav_abs_log", "new_prox_oob", "new_prox_clip",
            "prox_behav_oob", "flips", "sum_w", "sum_w2")


class StalenessStats:
    """Per-staleness sums of one logging window.

    Args:
        max_staleness: TRL's `max_staleness` (older samples are dropped before the loss); buckets 0 .. max_staleness.
        band: (low, high): a ratio r is out of band when r < low or r > high (`ratio_band_low/high`).
        epsilon_low, epsilon_high: the trainer's PPO clip.
        decoupled: whether a proximal policy exists (the `new_prox_*`, `prox_behav_*` and `is_*` stats are logged).
    """

    def __init__(self, max_staleness: int, band: tuple[float, float], epsilon_low: float, epsilon_high: float,
                 decoupled: bool):
        self.num_buckets = max_staleness + 1
        self.band = band
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high
        self.decoupled = decoupled
        self.sums: torch.Tensor | None = None  # (K + 1, F) fp64, created on the first update's device

    def _out_of_band(self, log_ratio: torch.Tensor) -> torch.Tensor:
        r = torch.exp(log_ratio.float())
        return ~((r >= self.band[0]) & (r <= self.band[1]))  # NaN counts as out of band

    def _clipped(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return ppo_clip_active(log_ratio[None], advantages[None], self.epsilon_low, self.epsilon_high)[0]

    def update(self, staleness: torch.Tensor, new: torch.Tensor, behaviour: torch.Tensor, prox: torch.Tensor,
               advantages: torch.Tensor, weights: torch.Tensor) -> None:
        """Add one micro-batch's trained terms.

        Args:
            staleness (`torch.Tensor` of shape (M,), int): k per term (-1: unknown, not counted).
            new (M,): the training forward's log-probs (detached). behaviour (M,): the sampler's.
            prox (M,): the proximal log-probs the loss clipped against (coupled: `behaviour`, TRL's ratio).
            advantages (M,): the terms' advantages before any IS weight. weights (M,): the IS weight applied (1s
                when none).
        """
        new, behaviour, prox = new.detach().float(), behaviour.float(), prox.float()
        known = (staleness >= 0) & (staleness < self.num_buckets)  # (M,)
        coupled = new - behaviour  # (M,) log new/behaviour
        decoupled = new - prox  # (M,) log new/prox
        clip_coupled = self._clipped(coupled, advantages)
        # the share of tokens whose clip status the staleness flips: clipped under new/behaviour (staleness and
        # engine folded in) vs under the ratio the objective clips (coupled: against the proximal policy that is the
        # training forward itself, r = 1, never clipped)
        clip_decoupled = self._clipped(decoupled, advantages) if self.decoupled else torch.zeros_like(clip_coupled)
        w = weights.float()
        columns = torch.stack([
            torch.ones_like(coupled), self._out_of_band(coupled).float(), clip_coupled.float(),
            torch.nan_to_num(coupled.abs(), nan=0.0, posinf=0.0), self._out_of_band(decoupled).float(),
            clip_decoupled.float(), self._out_of_band(prox - behaviour).float(),
            (clip_coupled != clip_decoupled).float(), w, w.square(),
        ], dim=1).double()  # (M, F)
        bucket = staleness.clamp(0, self.num_buckets - 1).long()  # (M,)
        part = torch.zeros(self.num_buckets, len(_COLUMNS), dtype=torch.float64, device=columns.device)
        # unknown terms add zeros (where, not a boolean-mask selection: its data-dependent size syncs the host)
        part.index_add_(0, bucket, torch.where(known[:, None], columns, 0.0))
        self.sums = part if self.sums is None else self.sums.to(part.device) + part

    def flush(self, accelerator=None) -> dict[str, float]:
        """The window's metrics (summed over processes when `accelerator` is given: every process must call it), then
        reset. Buckets without a token are absent; `{}` when nothing was added on any process."""
        sums = self.sums
        if accelerator is not None and accelerator.num_processes > 1:
            device = accelerator.device
            sums = torch.zeros(self.num_buckets, len(_COLUMNS), dtype=torch.float64, device=device) \
                if sums is None else sums.to(device)
            sums = accelerator.reduce(sums, reduction="sum")
        self.sums = None
        if sums is None:
            return {}
        metrics = {}
        for k, row in enumerate(sums.tolist()):  # the one host read of the window
            col = dict(zip(_COLUMNS, row, strict=True))
            n = col["tokens"]
            if n == 0:
                continue
            values = {
                "num_tokens": n,
                "new_behav_oob_rate": col["new_behav_oob"] / n,
                "new_behav_clip_rate": col["new_behav_clip"] / n,
                "new_behav_mean_abs_log_ratio": col["new_behav_abs_log"] / n,
                "clip_flip_rate": col["flips"] / n,
            }
            if self.decoupled:
                values |= {
                    "new_prox_oob_rate": col["new_prox_oob"] / n,
                    "new_prox_clip_rate": col["new_prox_clip"] / n,
                    "prox_behav_oob_rate": col["prox_behav_oob"] / n,
                    "is_weight_mean": col["sum_w"] / n,
                    "is_ess": col["sum_w"] ** 2 / (n * col["sum_w2"]) if col["sum_w2"] > 0 else 0.0,
                }
            assert set(values) <= set(STALENESS_STATS)
            metrics |= {staleness_key(k, stat): value for stat, value in values.items()}
        return metrics
