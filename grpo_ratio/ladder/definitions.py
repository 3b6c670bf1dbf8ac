"""The mismatch ladders as data: per source of mismatch a dial (settings -> config overrides) and the corrections that
address it (-> config overrides), each described in words (issue 41, docs/when_it_matters.md).

A ladder cell is (setting, correction, seed): one GRPO run with the testbed's config, then the setting's overrides,
then the correction's. Every ladder has one uncorrected correction (the verdicts' baseline at each setting) and one
reference setting (no mismatch: the baseline of the "did the uncorrected run lose reward" verdict). The overrides are
plain `RatioGRPOConfig` field values; nothing here imports a trainer or a config class (the ladder wing reads files
only: `benchmarks/ladder.py` runs the cells). The preset names are checked against
`grpo_ratio.corrections.is_correction.PRESETS` by tests/test_ladder.py.

Sources:
- `staleness`: the synchronous trainer's own dial. `steps_per_generation = (k + 1) x gradient_accumulation_steps`
  with `num_iterations=1`: each generation batch feeds k + 1 optimizer steps, so its last update trains on rollouts k
  optimizer steps behind the policy (k = 0, 1, 3, 7; 15 pushes the dial past what users meet). TRL then runs its old pass at generation time, so new/old is the
  honest staleness ratio. Uncorrected: that ratio unclipped (TRL's `epsilon` very large: plain importance sampling,
  no trust region); PPO's clip (TRL's default, epsilon 0.2); DPPO's trust region (`trust_region="dppo_tv"`, the clip
  opened as in the uncorrected arm so the mask alone acts). The `is_correction` presets do not apply here: they weigh
  old/sampler, and the synchronous trainer's old pass runs at generation time, at the sampler's own weights, so
  staleness never reaches that ratio (the asynchronous trainer's `max_staleness` lane is not in this ladder).
- `truncation`: top_p 1.0 / 0.95 / 0.8 / 0.5 and a top_k, against `truncation_correction` none / renormalize /
  lift_sampler. `lift_sampler` alone changes only the diagnostics (docs/truncation.md), so it runs with the `tis`
  IS correction, next to `tis` without it: the case where an IS weight reads the kept mass as mismatch.
- `precision`: rollouts drawn by a lower-precision copy of the policy (`rollout_precision`: policy / bf16 / fp16 /
  int8 / int4 / int2 / integer), against none / `is_correction` tis / icepop / geometric_mask / the `sampler` arm.
- `routing`: a tiny MoE policy at the staleness dial's settings, `routing_replay` none / R2 / R3.
- `async_staleness`: the asynchronous trainer's own dial (`RatioAsyncGRPOTrainer` against a vLLM server,
  `max_staleness` 0, 1, 3, 7 syncs, the rollout queue sized so that rollouts wait that long), against
  `async_objective` coupled (TRL's loss) / decoupled (AReaL's decoupled PPO) / decoupled with `tis`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..diagnostics import metric_keys as keys
from ..modes import INTEGER_MODE, SAMPLER_MODE


OPEN_CLIP = 1e9  # TRL's `epsilon` that makes the PPO clip [1 - eps, 1 + eps] inactive: the plain IS ratio
STALENESS = "staleness"  # a distance read from the run's configuration, not a logged key (`config_staleness`)


@dataclass(frozen=True)
class Setting:
    """One rung of a dial: `name` (its folder), `value` (the dial's value in its own unit, for tables and the rule's
    order), the config `overrides` and a one-line `description`."""

    name: str
    value: float
    overrides: dict
    description: str


@dataclass(frozen=True)
class Correction:
    """One treatment of a source: `name` (the arm label, its run folders `<name>-s<seed>`), the config `overrides`,
    a `description`, `extra_passes` (forward passes it adds per generation batch, in words) and whether it is the
    ladder's `uncorrected` arm."""

    name: str
    overrides: dict
    description: str
    extra_passes: str = "none"
    uncorrected: bool = False


@dataclass(frozen=True)
class Distance:
    """What the rule compares a user's run with: `key`, a metric logged at step 1 (or `STALENESS`: the run's
    configuration), `label` in words, and `one_minus` (the distance is 1 - the logged value, e.g. the kept mass)."""

    key: str
    label: str
    one_minus: bool = False


@dataclass(frozen=True)
class Ladder:
    """A source's dial and corrections. `reference` names the setting without mismatch; `distance` what the rule
    reads; `needs_field` a config field the ladder cannot run without (None: any checkout); `arch` the tiny testbed's
    architecture; `applies_key` a logged key whose presence says a user's run can have this mismatch (None: every
    run); `trainer` which trainer runs its cells: "sync" (`RatioGRPOTrainer`) or "async" (`RatioAsyncGRPOTrainer`,
    its overrides `RatioAsyncGRPOConfig` fields; `queue_steps: n` the rollout queue sized to n optimizer steps of
    samples)."""

    source: str
    description: str
    dial: str
    settings: tuple[Setting, ...]
    corrections: tuple[Correction, ...]
    reference: str
    distance: Distance
    needs_field: str | None = None
    arch: str = "qwen2"
    applies_key: str | None = None
    trainer: str = "sync"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def uncorrected(self) -> Correction:
        return next(c for c in self.corrections if c.uncorrected)

    def setting(self, name: str) -> Setting:
        """The setting called `name`. Raises KeyError naming the allowed ones."""
        found = {s.name: s for s in self.settings}
        if name not in found:
            raise KeyError(f"{self.source}: no setting {name!r}; allowed: {', '.join(found)}")
        return found[name]

    def correction(self, name: str) -> Correction:
        """The correction called `name`. Raises KeyError naming the allowed ones."""
        found = {c.name: c for c in self.corrections}
        if name not in found:
            raise KeyError(f"{self.source}: no correction {name!r}; allowed: {', '.join(found)}")
        return found[name]

    def overrides(self, setting: str, correction: str) -> dict:
        """The config overrides of one cell: the setting's, then the correction's (a correction wins a shared key)."""
        return {**self.setting(setting).overrides, **self.correction(correction).overrides}


def _staleness_settings() -> tuple[Setting, ...]:
    """k = 0, 1, 3, 7, 15 optimizer steps behind; `steps_per_generation` is in units of gradient_accumulation_steps
    (the runner multiplies, `staleness_overrides`)."""
    return tuple(Setting(f"k{k}", k, {"staleness": k},
                         f"steps_per_generation = {k + 1} x gradient_accumulation_steps: the last update of each "
                         f"generation batch trains on rollouts {k} optimizer step{'s' * (k != 1)} old")
                 for k in (0, 1, 3, 7, 15))


def staleness_overrides(overrides: dict, gradient_accumulation_steps: int, samples_per_step: int = 1) -> dict:
    """`overrides` with the ladder's `staleness: k` replaced by TRL's `steps_per_generation = (k + 1) x GA`, and
    `queue_steps: n` by the asynchronous trainer's `queue_maxsize = n x samples_per_step` (the other keys unchanged)."""
    out = dict(overrides)
    if "staleness" in out:
        out["steps_per_generation"] = (int(out.pop("staleness")) + 1) * gradient_accumulation_steps
    if "queue_steps" in out:
        out["queue_maxsize"] = int(out.pop("queue_steps")) * samples_per_step
    return out


def config_staleness(config: dict | None) -> float | None:
    """Optimizer steps the oldest rollouts of a synchronous run are behind the policy that trains on them:
    steps_per_generation / gradient_accumulation_steps x num_iterations - 1 (0 in TRL's default); an asynchronous
    run's `max_staleness`; None when the configuration does not say."""
    if not config:
        return None
    if config.get("max_staleness") is not None:
        return float(config["max_staleness"])
    ga = config.get("gradient_accumulation_steps") or 1
    spg = config.get("steps_per_generation") or ga
    return float(spg // ga * (config.get("num_iterations") or 1) - 1)


_PPO_CLIP = Correction("ppo_clip", {"epsilon": 0.2},
                       "PPO's clip of new/old at [0.8, 1.2] (TRL's default, epsilon 0.2)")
_OPEN = {"epsilon": OPEN_CLIP}
STALENESS_LADDER = Ladder(
    source="staleness",
    description="rollouts generated k optimizer steps before the update that trains on them (synchronous trainer)",
    dial="steps_per_generation (= (k + 1) x gradient_accumulation_steps, num_iterations=1)",
    settings=_staleness_settings(),
    corrections=(
        Correction("none", _OPEN, "new/old unclipped (epsilon 1e9): plain importance sampling, no trust region",
                   uncorrected=True),
        _PPO_CLIP,
        Correction("dppo_tv", {**_OPEN, "trust_region": "dppo_tv"},
                   "DPPO's binary-TV trust region (trust_region='dppo_tv', bounds 0.15) with the clip opened"),
    ),
    reference="k0",
    distance=Distance(STALENESS, "staleness (optimizer steps between a rollout and its last update)"),
    notes=("The is_correction presets weigh old/sampler, which synchronous staleness never moves (the old pass runs at "
           "generation time): they are not rungs of this ladder.",),
)

TRUNCATION_LADDER = Ladder(
    source="truncation",
    description="sampling truncated by top_p / top_k, trained on the full-vocabulary policy",
    dial="top_p (and top_k)",
    settings=(
        Setting("top_p_1.0", 1.0, {"top_p": 1.0}, "untruncated sampling (TRL's default)"),
        Setting("top_p_0.95", 0.95, {"top_p": 0.95}, "nucleus 0.95"),
        Setting("top_p_0.8", 0.8, {"top_p": 0.8}, "nucleus 0.8"),
        Setting("top_p_0.5", 0.5, {"top_p": 0.5}, "nucleus 0.5"),
        Setting("top_p_0.2", 0.2, {"top_p": 0.2}, "nucleus 0.2: past what users set, to push the dial"),
        Setting("top_k_5", 5, {"top_k": 5}, "the 5 most likely tokens"),
    ),
    corrections=(
        Correction("none", {}, "TRL's loss on tokens sampled from the truncated distribution, full-vocabulary target",
                   uncorrected=True),
        Correction("renormalize", {"truncation_correction": "renormalize"},
                   "trainer log-probs over the kept set: the truncated policy becomes the target"),
        Correction("tis", {"is_correction": "tis"},
                   "token TIS (cap 2) on raw old/sampler: the weight reads the kept mass as mismatch"),
        Correction("score_centering", {"score_centering": "exact"},
                   "score centering: the sampler-expected score subtracted at each prefix, q the truncated "
                   "distribution recomputed from the training forward (Marek & Ryabinin, arXiv 2609.20807)",
                   extra_passes="none; one more LM-head pass forward and backward per training forward, in chunks"),
        Correction("lift_sampler", {"truncation_correction": "lift_sampler", "is_correction": "tis"},
                   "token TIS on old/sampler with the sampler's log-probs lifted by the kept mass",
                   extra_passes="one no-grad old pass per generation batch (on-policy bf16)"),
    ),
    reference="top_p_1.0",
    distance=Distance(keys.OLD_SAMPLER.mean, "step-1 truncated mass (1 - mean old/sampler ratio)",
                      one_minus=True),
)

PRECISION_LADDER = Ladder(
    source="precision",
    description="rollouts drawn by a lower-precision copy of the policy than the one trained",
    dial="rollout_precision",
    settings=(
        Setting("policy", 0, {"rollout_precision": "policy"}, "the policy itself draws the rollouts"),
        Setting("bf16", 1, {"rollout_precision": "bf16"}, "a bf16 copy draws them"),
        Setting("fp16", 2, {"rollout_precision": "fp16"}, "an fp16 copy draws them"),
        Setting("int8", 3, {"rollout_precision": "int8"}, "an int8 copy draws them"),
        Setting("int4", 4, {"rollout_precision": "int4"}, "an int4 copy draws them"),
        Setting("int2", 5, {"rollout_precision": "int2"},
                "an int2 (ternary) copy draws them: past the coarsest copy users run, to push the dial"),
        Setting(INTEGER_MODE, 6, {"rollout_precision": INTEGER_MODE}, "the integer-only sampler (docs/integer.md)"),
    ),
    corrections=(
        Correction("none", {}, "no correction: the trainer's old pass, sampler log-probs only measured",
                   uncorrected=True),
        Correction("tis", {"is_correction": "tis"}, "token TIS, cap 2"),
        Correction("icepop", {"is_correction": "icepop"}, "IcePop: token weights masked outside [0.5, 5]"),
        Correction("geometric_mask", {"is_correction": "geometric_mask"},
                   "sequences whose geometric-mean ratio leaves [0.99, 1.01] masked"),
        Correction(SAMPLER_MODE, {"old_logprob_mode": SAMPLER_MODE},
                   "old log-probs = the sampler's: PPO's ratio becomes policy / sampler",
                   extra_passes="one fewer: no old pass"),
    ),
    reference="policy",
    distance=Distance(keys.mismatch_key(keys.OLD_SAMPLER, "kl_k3"), "step-1 old/sampler k3"),
    needs_field="rollout_precision",
)

ROUTING_LADDER = Ladder(
    source="routing",
    description="a tiny MoE policy trained on stale rollouts: routes chosen by another policy than the one trained",
    dial="steps_per_generation (as the staleness ladder)",
    settings=_staleness_settings(),
    corrections=(
        Correction("none", {"routing_replay": "none"}, "every forward routes itself (stock TRL)", uncorrected=True),
        Correction("R2", {"routing_replay": "R2"}, "the old pass's routes replayed in every update"),
        Correction("R3", {"routing_replay": "R3"}, "the sampler's routes replayed in the old pass and every update"),
    ),
    reference="k0",
    distance=Distance(STALENESS, "MoE staleness (optimizer steps between a rollout and its last update)"),
    arch="qwen3_moe",
    applies_key=keys.route_key("sampler_old", "any_layer"),
)

ASYNC_STALENESS_LADDER = Ladder(
    source="async_staleness",
    description="rollouts sampled by a vLLM server up to k weight syncs before the update that trains on them "
                "(asynchronous trainer, one sync per optimizer step)",
    dial="max_staleness (the rollout queue holds max_staleness + 1 optimizer steps of samples)",
    settings=tuple(Setting(f"k{k}", k, {"max_staleness": k, "queue_steps": k + 1},
                           f"max_staleness={k}: samples more than {k} sync{'s' * (k != 1)} old dropped, the queue "
                           f"{k + 1} step{'s' * (k != 0)} deep, so that rollouts wait up to {k} sync{'s' * (k != 1)}")
                   for k in (0, 1, 3, 7)),
    corrections=(
        Correction("coupled", {"async_objective": "coupled"},
                   "TRL's loss: PPO's clip on new/behaviour (epsilon 0.2), the stale sampler as the old policy",
                   uncorrected=True),
        Correction("decoupled", {"async_objective": "decoupled"},
                   "AReaL's decoupled PPO: the clip on new/proximal, the raw behaviour -> proximal IS weight",
                   extra_passes="none (the proximal log-probs are the training forward's, old_logprob_mode='bf16')"),
        Correction("decoupled_tis", {"async_objective": "decoupled", "is_correction": "tis"},
                   "decoupled PPO with the behaviour -> proximal weight capped at 2 (token TIS)",
                   extra_passes="none"),
    ),
    reference="k0",
    distance=Distance(STALENESS, "asynchronous staleness (max_staleness: weight syncs between a rollout's sampler "
                                 "and the update)"),
    trainer="async",
    notes=("Realized staleness is what the queue and the two processes' speeds make of the cap; each cell logs it "
           "(TRL's sample/staleness_mean, and the ratio/staleness/<k>/* buckets).",),
)

# Threshold sweeps (issue 41, item 5): at the staleness ladder's worst setting (k = 7; k = 15 where DPPO-TV recovered
# a loss at learning rate 1e-2), and at the precision ladder's int2 for the geometric mask, one knob per ladder, each
# value a setting; the uncorrected arm (`none`) is the baseline at every value. Run with
# `--name thresholds/<source>`, so that they sit apart from the ladders (docs/when_it_matters.md, "Thresholds").
_SWEPT = Correction("swept", {}, "the correction at the setting's value of the knob")
_NO_TRUST_REGION = {**_OPEN, "trust_region": None, "trust_region_low": None, "trust_region_high": None}
PPO_EPSILON_SWEEP = Ladder(
    source="ppo_epsilon",
    description="PPO's clip width at rollouts 7 optimizer steps behind",
    dial="epsilon (TRL's clip [1 - eps, 1 + eps]) at staleness k = 7",
    settings=tuple(Setting(f"eps_{e}", e, {"staleness": 7, "epsilon": e},
                           f"clip at [{1 - e:g}, {1 + e:g}]" + (" (TRL's default)" if e == 0.2 else ""))
                   for e in (0.1, 0.2, 0.5, 1.0)),
    corrections=(Correction("none", _OPEN, "new/old unclipped (epsilon 1e9)", uncorrected=True), _SWEPT),
    reference="eps_0.2",
    distance=Distance(STALENESS, "staleness (optimizer steps between a rollout and its last update)"),
)
def _dppo_tv_sweep(k: int) -> Ladder:
    """DPPO-TV's bound swept at staleness k (the source `dppo_tv_delta`, `dppo_tv_delta_k<k>` off k = 7)."""
    return Ladder(
        source="dppo_tv_delta" if k == 7 else f"dppo_tv_delta_k{k}",
        description=f"DPPO's binary-TV trust region width at rollouts {k} optimizer steps behind",
        dial=f"trust_region_low = trust_region_high (delta) with trust_region='dppo_tv', the clip opened, at k = {k}",
        settings=tuple(Setting(f"delta_{d}", d, {"staleness": k, **_OPEN, "trust_region": "dppo_tv",
                                                   "trust_region_low": d, "trust_region_high": d},
                               f"tokens whose |p_new - p_old| leaves {d:g} on the advantage's side masked"
                               + (" (the default)" if d == 0.15 else ""))
                       for d in (0.05, 0.15, 0.3, 0.6)),
        corrections=(Correction("none", _NO_TRUST_REGION, "no trust region, the clip opened", uncorrected=True),
                     _SWEPT),
        reference="delta_0.15",
        distance=Distance(STALENESS, "staleness (optimizer steps between a rollout and its last update)"),
    )


DPPO_TV_SWEEP = _dppo_tv_sweep(7)
# where DPPO-TV recovered an uncorrected loss: k = 15 at learning rate 1e-2 (run with --set learning_rate=1e-2)
DPPO_TV_SWEEP_K15 = _dppo_tv_sweep(15)
# where the geometric_mask preset's band over-masked: int2 rollouts (run with --set learning_rate=1e-2); each band as
# the preset's own rule (`is_correction="custom"`, no IS weight, sequences whose geometric-mean old/sampler ratio
# leaves [low, high] dropped)
_NO_IS = {"is_correction": None, "is_correction_level": None, "is_correction_rejection": None}
GEOMETRIC_MASK_SWEEP = Ladder(
    source="geometric_mask_band",
    description="the geometric-mask band at rollouts drawn by an int2 copy of the policy",
    dial="is_correction='custom', is_correction_level='none', rejection low <= seq_mean_ratio <= high, at "
         "rollout_precision='int2'",
    settings=tuple(Setting(f"band_{high:g}", high,
                           {"rollout_precision": "int2", "is_correction": "custom", "is_correction_level": "none",
                            "is_correction_rejection": f"{low:g}<=seq_mean_ratio<={high:g}"},
                           f"sequences whose geometric-mean ratio leaves [{low:g}, {high:g}] masked"
                           + (" (the geometric_mask preset)" if high == 1.01 else ""))
                   for low, high in ((0.99, 1.01), (0.9, 1.1), (0.5, 2.0), (0.2, 5.0))),
    corrections=(Correction("none", _NO_IS, "no IS correction (int2 rollouts, the trainer's old pass)",
                            uncorrected=True), _SWEPT),
    reference="band_1.01",
    distance=Distance(keys.mismatch_key(keys.OLD_SAMPLER, "kl_k3"), "step-1 old/sampler k3"),
    needs_field="rollout_precision",
)
SWEEPS: dict[str, Ladder] = {lad.source: lad for lad in (PPO_EPSILON_SWEEP, DPPO_TV_SWEEP, DPPO_TV_SWEEP_K15,
                                                         GEOMETRIC_MASK_SWEEP)}

LADDERS: dict[str, Ladder] = {lad.source: lad for lad in
                              (STALENESS_LADDER, TRUNCATION_LADDER, PRECISION_LADDER, ROUTING_LADDER,
                               ASYNC_STALENESS_LADDER, *SWEEPS.values())}


def ladder(source: str) -> Ladder:
    """The ladder of `source`. Raises KeyError naming the allowed sources."""
    if source not in LADDERS:
        raise KeyError(f"no ladder {source!r}; allowed: {', '.join(LADDERS)}")
    return LADDERS[source]
