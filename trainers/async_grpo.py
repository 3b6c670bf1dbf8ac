"""Asynchronous GRPO with grpo_ratio: TRL's async trainer against a running vLLM server, the policy a LoRA adapter
synced to the server after every step, the arithmetic task (docs/async.md: the server commands, GPU and CPU).

    python trainers/async_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --server-url http://localhost:8000
    python trainers/async_grpo.py --cpu ...   # a CPU machine: TRL's CUDA-only pieces stood in for (trials, tests)
"""

import argparse
import contextlib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model the server serves (id or directory)")
    parser.add_argument("--server-url", default="http://localhost:8000")
    parser.add_argument("--output-dir", default="async_out")
    parser.add_argument("--objective", default="decoupled", help="async_objective: coupled, decoupled, "
                        "decoupled_loglinear")
    parser.add_argument("--is-correction", default="tis", help="the behaviour -> proximal weight (decoupled only)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=8, help="at most the server's --max-lora-rank")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (grpo_ratio.testing.async_cpu)")
    a = parser.parse_args()
    import torch

    if not a.cpu and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: add --cpu (TRL's async trainer runs CUDA kernels; docs/async.md)")

    from peft import LoraConfig

    from grpo_ratio import RatioAsyncGRPOConfig, RatioAsyncGRPOTrainer
    from grpo_ratio.tasks import load_task

    dataset, rewards = load_task("arithmetic", num_examples=256)
    args = RatioAsyncGRPOConfig(
        output_dir=a.output_dir,
        vllm_server_base_url=a.server_url,
        async_objective=a.objective,  # "coupled" is TRL's loss, bit for bit
        is_correction=a.is_correction if a.objective != "coupled" else "none",
        max_staleness=2,  # the server needs --max-loras >= max_staleness + 2
        weight_sync_steps=1,
        max_steps=a.max_steps,
        max_completion_length=a.max_completion_length,
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        token_budget=0,  # 4 samples per micro-batch, whatever their length
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        queue_maxsize=16,  # the rollout worker stops 2 steps ahead instead of filling the queue by the hundred
        use_cpu=a.cpu,  # weights in fp32 (TRL's `dtype` default, the server's --dtype float32) on either device;
        bf16=not a.cpu,  # bf16 autocast on a GPU (TRL's default), none on a CPU
        gradient_checkpointing=False,
    )
    lora = LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    on_cpu = contextlib.nullcontext()
    if a.cpu:
        from grpo_ratio.testing.async_cpu import async_grpo_on_cpu

        on_cpu = async_grpo_on_cpu()
    with on_cpu:
        trainer = RatioAsyncGRPOTrainer(model=a.model, reward_funcs=rewards, args=args, train_dataset=dataset,
                                        peft_config=lora)
        trainer.train()
    print(f"done: {trainer.state.global_step} steps; per staleness: grpo-ratio report {a.output_dir}")


if __name__ == "__main__":
    main()
