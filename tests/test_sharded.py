"""Scoring modes under real FSDP2 and DeepSpeed ZeRO-3 sharding: 2 CPU processes, tiny models, `accelerate launch`.

Run: pytest tests/test_sharded.py                 (FSDP2, bf16 policy and none: 2 launches, about 1 minute each)
     pip install -e ".[deepspeed]" && pytest -m slow tests/test_sharded.py   (ZeRO-3, bf16 and fp32; the first run on
     a machine compiles one DeepSpeed CPU op, about 1.5 minutes, then about 1 minute per launch)

Each launch (tests/sharded_modes.py) checks every mode on both head kinds; under ZeRO-3 also `bf16` against stock
TRL (equal loss and metrics) and `sampler`; the assertions are here. A run that silently fell back to DDP (or ran
another ZeRO stage) fails at the sharding evidence.
"""

import json
import math
import os
import sys
from pathlib import Path

import pytest

from grpo_ratio.testing.ranks import run_ranks
from grpo_ratio.testing.sharded import cpu_launch_config


ROOT = Path(__file__).resolve().parents[1]
MODES = ("fp32_clone", "fp16_clone", "fp32_head", "guided_fp32")


def launch(tmp_path, engine: str, precision: str, script: str = "sharded_modes.py", *extra: str) -> list[dict]:
    """Run tests/`script` under `accelerate launch` with the recipe's config made CPU-ready (`extra`: more
    arguments for the script)."""
    recipe = ROOT / "recipes" / "accelerate_configs" / ("fsdp2.yaml" if engine == "fsdp2" else "zero3.yaml")
    config = cpu_launch_config(str(recipe), tmp_path, bf16=precision == "bf16")
    out = tmp_path / "result.json"
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [str(accelerate), "launch", "--config_file", config, str(ROOT / "tests" / script), str(out),
           engine, precision, *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    # raises past 900 s or when a process outlives the launch (killed either way, ranks in their own sessions too)
    (proc,) = run_ranks([cmd], timeout=900, envs=[env], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def check(ranks: list[dict], engine: str, precision: str) -> None:
    assert len(ranks) == 2
    for rank, run in enumerate(ranks):
        assert run["world_size"] == 2
        assert run["compute_dtype"] == ("torch.bfloat16" if precision == "bf16" else "torch.float32")
        for mode in MODES:
            for head, row in run["modes"][mode].items():
                check_row(row, engine, precision, mode, f"rank {rank} {precision} {mode} {head}")
        check_fallback(run["fp16_fallback"], rank)
        assert "PEFT adapter is not supported" in run["peft_refused"]


def check_evidence(evidence: dict, engine: str, where: str) -> None:
    """Real sharding, not a silent DDP fallback: the distributed type, every parameter partitioned in halves, and
    under DeepSpeed the engine's own ZeRO stage 3 with its stage-3 optimizer."""
    assert evidence["distributed_type"].endswith("FSDP" if engine == "fsdp2" else "DEEPSPEED"), where
    assert evidence["num_sharded"] == evidence["num_params"] > 0, where
    assert evidence["largest_local"] * 2 == evidence["largest_full"], where
    if engine == "zero3":
        assert evidence["zero_stage"] == 3 and evidence["optimizer"] == "DeepSpeedZeroOptimizer_Stage3", where


def check_row(row: dict, engine: str, precision: str, mode: str, where: str) -> None:
    check_evidence(row["evidence"], engine, where)
    checks = row["checks"]
    assert len(checks) == (4 if engine == "fsdp2" else 2), where  # an old pass per step, second train() included
    assert max(c["max_abs"] for c in checks) == 0.0, where  # bitwise equal to the unsharded replica
    # the mode is not TRL's own pass in disguise: where the engine computes in bf16 every mode differs from it;
    # in fp32 only fp16_clone does
    differs = precision == "bf16" or mode == "fp16_clone"
    assert (min(c["gap_to_bf16_mode"] for c in checks) > 0) == differs, where
    assert row["policy_forward_unchanged"], where  # policy swaps leave the training forward bit-identical
    # fp32_head keeps its separate pass under a sharded engine (the old passes above are that pass), and says why
    assert not row["fused_head"], where
    if mode == "fp32_head":
        assert row["fused_head_fallback"].startswith(f"sharded engine ({engine})"), where
    check_copies(row, engine, precision, mode, where)


def check_copies(row: dict, engine: str, precision: str, mode: str, where: str) -> None:
    shadowed = mode == "fp16_clone" or (engine == "zero3" and precision == "bf16" and mode == "fp32_clone")
    checks = row["checks"]
    if not shadowed:  # the mode runs on the policy's own shards (or gathers fp32 masters per module): nothing kept
        assert all(c["copies"] == [] for c in checks) and row["extra_bytes"] == 0, where
        return
    for i, c in enumerate(checks):  # used at the trainer's version, refreshed exactly when it changed
        ((version, refreshes),) = c["copies"]
        assert version == c["version"] and refreshes == i + 1, where
    bytes_per_value = 4 if mode == "fp32_clone" else 2
    # this rank's half of the parameters (ZeRO-3 pads each partition, the buffers are whole on every rank)
    assert 0 <= row["extra_bytes"] - row["num_params"] * bytes_per_value // 2 < 512, where


def check_fallback(fallback: dict, rank: int) -> None:
    # overflow forced on rank 0 only: rank 0 re-scored its 2 bad rows in fp32, rank 1 ran the same fp32 forwards on
    # a dummy row (else the ranks deadlock) and kept its fp16 values; both equal the replica
    assert fallback["fallback_rows"] == (2 if rank == 0 else 0)
    assert fallback["finite"] and fallback["max_abs"] == 0.0


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp2_modes(tmp_path, precision):
    ranks = launch(tmp_path, "fsdp2", precision)
    check(ranks, "fsdp2", precision)
    for run in ranks:  # the new side: under the bf16 policy TRL's log-probs were rounded to bf16, now fp32
        side = run["new_side"]
        assert side["dtype_fixed"] == "torch.float32" and side["fix_idempotent"]
        if precision == "bf16" and side["accelerate_output_dtype"] == "torch.bfloat16":  # an accelerate that casts outputs
            assert side["dtype_unfixed"] == "torch.bfloat16" and side["unfixed_is_bf16_of_fixed"]
            assert side["max_abs_rounding"] > 1e-3
        else:  # no policy, or accelerate's policy without an output cast (1.16): nothing to fix, nothing changed
            assert side["accelerate_output_dtype"] == "None"
            assert side["dtype_unfixed"] == "torch.float32" and side["max_abs_rounding"] == 0.0


def check_trl_modes(ranks: list[dict], precision: str) -> None:
    """`bf16` is stock TRL under ZeRO-3 (loss and every TRL metric, both steps); `sampler` trains 2 steps."""
    for rank, run in enumerate(ranks):
        modes = run["trl_modes"]
        for name, row in modes.items():
            check_evidence(row["evidence"], "zero3", f"rank {rank} {precision} {name}")
            assert len(row["rows"]) == 2, name
        assert modes["bf16"]["rows"] == modes["stock"]["rows"]  # exactly equal, not close
        assert "ratio/new_old/oob_rate" in modes["bf16"]["ratio_keys"]  # and the diagnostics ran beside it
        assert all(r["loss"] == r["loss"] for r in modes["sampler"]["rows"])  # finite losses (NaN != NaN)
        assert "ratio/new_old/oob_rate" in modes["sampler"]["ratio_keys"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero3_modes(tmp_path, precision):
    pytest.importorskip("deepspeed", reason='ZeRO-3 tests need `pip install -e ".[deepspeed]"`')
    ranks = launch(tmp_path, "zero3", precision)
    check(ranks, "zero3", precision)
    check_trl_modes(ranks, precision)


# ---------------------------------------------------------------------------------------------------------------------
# MoE routing replay (tests/sharded_routing.py): a tiny Qwen3-MoE, every scoring mode under R3, R2 with an old pass


def check_routing(ranks: list[dict], engine: str) -> None:
    assert len(ranks) == 2
    for run in (r for rank in ranks for r in rank["runs"]):
        where = f"{run['mode']} {run['replay']}"
        evidence = run["evidence"]  # real sharding, not a silent DDP fallback
        assert evidence["distributed_type"].endswith("FSDP" if engine == "fsdp2" else "DEEPSPEED"), where
        assert evidence["num_sharded"] == evidence["num_params"] > 0, where
        # one generation, two updates (num_iterations=2, so TRL runs its own old pass in bf16 too); R3 also replays in
        # the old pass, which the sampler arm does not run; R2's old pass records
        old_pass = run["replay"] == "R3" and run["mode"] != "sampler"
        assert run["sessions"] == 2 + old_pass, where
        assert run["served_ok"] and run["from_source"], where  # every served index as given, rows of the source
        assert run["used"] and all(v == 0.0 for v in run["used"]), where  # the replayed pair: exactly 0
    for i, run in enumerate(ranks[0]["runs"]):  # the metric counts both ranks' tokens (summed over processes)
        other = ranks[1]["runs"][i]
        assert run["tokens"] == other["tokens"], run["mode"]
        assert run["tokens"][0] > run["local_positions"], run["mode"]


def test_fsdp2_routing_replay(tmp_path):
    check_routing(launch(tmp_path, "fsdp2", "bf16", "sharded_routing.py"), "fsdp2")


@pytest.mark.slow
def test_zero3_routing_replay(tmp_path):
    pytest.importorskip("deepspeed", reason='ZeRO-3 tests need `pip install -e ".[deepspeed]"`')
    check_routing(launch(tmp_path, "zero3", "bf16", "sharded_routing.py"), "zero3")


# ---------------------------------------------------------------------------------------------------------------------
# truncation corrections (tests/sharded_corrections.py): the kept-set log-probs read the LM head outside its forward


def check_corrections(ranks: list[dict], engine: str) -> None:
    """Every correction trains under the engine, and in fp32 the sampler and the trainer agree: the corrected
    old/sampler ratio is 1 and the raw one the kept mass, at the first update of both generations."""
    assert len(ranks) == 2
    for rank in ranks:
        for run in rank["runs"]:
            where = f"rank {rank['rank']} {run['mode']} {run['correction']} fp32_head={run['fp32_head']} {run['source']}"
            assert "error" not in run, f"{where}: {run.get('error')}"
            evidence = run["evidence"]  # real sharding, not a silent DDP fallback
            assert evidence["distributed_type"].endswith("FSDP" if engine == "fsdp2" else "DEEPSPEED"), where
            assert evidence["num_sharded"] == evidence["num_params"] > 0, where
            assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"]), where
            # under renormalize the head's gradient comes only from the kept-set log-probs (TRL's own head log-probs
            # are not in the loss): it moved, so that gradient reached the sharded head
            assert run["head_moved"] > 0, where
            logged = [i for i, v in enumerate(run["kept_mass"]) if v is not None]
            assert logged == [0, 2], where  # the first update of each generation (num_iterations=2)
            for i in logged:
                assert 0.5 < run["kept_mass"][i] < 1.0, where  # top_p=0.8 on a near-uniform tiny model
                assert abs(run["corrected"][i] - 1.0) < 1e-4, where
                assert abs(run["old_sampler"][i] - run["kept_mass"][i]) < 1e-4, where


def test_fsdp2_truncation_corrections(tmp_path):
    check_corrections(launch(tmp_path, "fsdp2", "fp32", "sharded_corrections.py"), "fsdp2")


@pytest.fixture(scope="module")
def zero3_corrections(tmp_path_factory):
    """One ZeRO-3 launch of tests/sharded_corrections.py, read by the two tests below."""
    pytest.importorskip("deepspeed", reason='ZeRO-3 tests need `pip install -e ".[deepspeed]"`')
    return launch(tmp_path_factory.mktemp("zero3_corrections"), "zero3", "fp32", "sharded_corrections.py")


@pytest.mark.slow
def test_zero3_truncation_corrections(zero3_corrections):
    check_corrections(zero3_corrections, "zero3")


@pytest.mark.slow
def test_zero3_second_train_is_refused_up_front(zero3_corrections):
    for rank in zero3_corrections:  # refused before it starts, on every rank, with what to do instead (stock TRL:
        # "AttributeError: 'NoneType' object has no attribute 'backward'" from inside transformers)
        assert rank["second_train"].startswith("RuntimeError: train() was already called on this trainer, and under "
                                               "DeepSpeed ZeRO-3 a second train() cannot run")
        assert "Build a new trainer" in rank["second_train"]


def test_an_fsdp2_config_that_runs_ddp_on_cpu_is_said_at_start(tmp_path):
    # accelerate left as it is (no test patch): on CPU processes it keeps MULTI_CPU under the FSDP2 config and
    # trains plain DDP; the trainer says so when it is built, on every process
    ranks = launch(tmp_path, "fsdp2", "fp32", "sharded_corrections.py", "unpatched")
    for rank in ranks:
        assert rank["distributed_type"].endswith("MULTI_CPU") and rank["num_processes"] == 2
        (said,) = rank["said"]
        assert said.startswith("the launch asked for FSDP ") and "plain DDP on 2 CPU processes (gloo)" in said
