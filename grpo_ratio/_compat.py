"""Fail early, with a clear message, on a TRL release whose private methods we have not tested.

RatioGRPOTrainer wraps three private methods of `trl.GRPOTrainer`: `_generate_and_score_completions`,
`_get_per_token_logps_and_entropies` and `_generate_single_turn` (see docs/trl_hooks.md). Their signatures and the
order of the calls inside them change between TRL releases, so an untested release is refused at import.
"""

import trl
from packaging.version import Version


TESTED_TRL = (Version("1.16.0"), Version("1.17.0"))  # [low, high)


def check_trl_version(version: str = trl.__version__) -> None:
    """Raise `ImportError` unless `version` is in the tested TRL range `[1.16.0, 1.17.0)`.

    Set the environment variable `GRPO_RATIO_SKIP_TRL_CHECK=1` to try an untested release at your own risk.
    """
    import os

    if os.environ.get("GRPO_RATIO_SKIP_TRL_CHECK") == "1":
        return
    low, high = TESTED_TRL
    if not (low <= Version(version) < high):
        raise ImportError(
            f"grpo_ratio is tested with trl>={low},<{high} but found trl=={version}. It wraps private GRPOTrainer "
            f"methods (_generate_and_score_completions, _get_per_token_logps_and_entropies, _generate_single_turn) "
            f"whose behaviour changes between releases. Install a tested release: pip install 'trl>={low},<{high}' "
            f"(or set GRPO_RATIO_SKIP_TRL_CHECK=1 to try anyway)."
        )
