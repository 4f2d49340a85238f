import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import PARITY, PARITY_FP32, WHOLE_LOGITS, train  # noqa: E402


@pytest.fixture(scope="session")
def debug_reference(tmp_path_factory):
    """One process, one micro-batch of 4, in fp64: the plain single-device computation that every layout of
    the debug model at the PARITY setting must reproduce to EXACT (shared by every test module). With the whole
    logits, where the PARITY runs compute the loss in chunks: the chunked loss is held to it on every layout."""
    return train(tmp_path_factory.mktemp("ref") / "run", *PARITY, "train.micro_batch_size=4", WHOLE_LOGITS)


@pytest.fixture(scope="session")
def debug_reference_fp32(tmp_path_factory):
    """The same in fp32: the reference of the low-precision and compression tests (what users run)."""
    return train(tmp_path_factory.mktemp("ref32") / "run", *PARITY_FP32, "train.micro_batch_size=4")


# The longest modules first: with `make test`'s workers taking one module at a time, the suite ends on short
# modules instead of one worker running a long one while the others idle.
LONGEST_FIRST = ("test_quickstart", "test_ray", "test_context_parallel", "test_chat_data", "test_fault_tolerance",
                 "test_model_parallel", "test_demo", "test_user_models", "test_dryrun", "test_object_storage",
                 "test_observability", "test_sharding", "test_loss", "test_parity", "test_plan", "test_balance",
                 "test_optimizers", "test_hf", "test_hf_families", "test_dryrun_moe", "test_runtime", "test_lease",
                 "test_lora", "test_moe", "test_interrupts", "test_resolve", "test_plan_moe", "test_planner_grid",
                 "test_hub", "test_deepspeed", "test_export", "test_resume", "test_plan_objectives", "test_plan_published",
                 "test_published_models", "test_preference", "test_plan_zero_bubble", "test_plan_gemma4",
                 "test_dryrun_cuda_attention", "test_plan_published_context")


# What `make test` leaves to `make test-slow` (CI's `.ci/run` runs both, so nothing is tested by hand only): the
# longest multi-process matrices, whose layouts the fast tier still covers once each (DDP, ZeRO, TP, PP, CP, EP,
# Hugging Face and LoRA, each in a shorter test), keyed by module and by a fixture or test name (a prefix).
SLOW_TIER = {
    "test_hf": ("two_rank_runs",),  # every Hugging Face family under every layout (one 2-rank launch)
    "test_hf_families": ("family_runs", "references"),  # the 2026 families under the layouts they take
    "test_linear_attention_documents": ("two_rank_runs", "references"),  # Gated DeltaNet document masking, trained
    "test_lora": ("two_rank_runs",  # LoRA under every layout; its dry run against the planner stays under ZeRO-3
                  "test_the_dry_run_trains_the_adapters_alone_and_the_planner_follows[layout1"),
    "test_optimizers": ("muon_layouts",),  # Muon under every layout, resharded resumes, the split counted
    "test_moe": ("test_expert_parallel_equals_one_process",),
    "test_dryrun": ("test_dry_run_equals_a_real_run", "test_3d_states_follow_the_planner_at_8_ranks",
                    *(f"test_model_states_follow_the_zero_arithmetic_at_32_ranks[{i}" for i in (1, 2, 3)),
                    *(f"test_pipeline_transfers_at_8_ranks[{s}" for s in ("gpipe", "interleaved", "zero_bubble")),
                    "test_hugging_face_models_follow_the_zero_arithmetic[qwen2"),  # each kind once in the fast tier
    "test_dryrun_moe": ("test_experts_outside_fsdp_on_a_one_rank_expert_mesh[3-1",
                        "test_experts_outside_fsdp_on_a_one_rank_expert_mesh[2-2",
                        "test_dry_run_of_expert_parallel_under_zero1"),
    "test_user_models": ("test_the_example_runs_from_its_readme",),
    "test_object_storage": ("test_preempted_then_killed_launch",),
    "test_planner_grid": ("test_",),  # the planner against the dry run, row by row
    "test_plan": tuple(f"test_the_written_config_is_the_planned_layout[{row}" for row in ("7b-16", "13b", "70b", "qwen3")),
    "test_context_parallel": ("four_lean",),  # 4-rank compositions and a resume onto cp=2 x dp_shard=2
    "test_balance": ("four_rank_runs",),
    "test_sharding": ("four_rank_runs",),
    "test_chat_data": ("test_the_sft_example_end_to_end",),
    "test_observability": ("test_bench_scaling_table_and_plot",),
    "test_model_parallel": ("four_rank_runs", "test_three_d_on_eight_ranks"),  # compositions; TP and PP stay
    "test_deepspeed": ("deepspeed_runs",  # ZeRO-2/3 under DeepSpeed against the torch engine, resumed
                       "test_resuming_under_the_other_engine"),  # a DeepSpeed run: ~20 CPU-s of imports alone
    "test_fault_tolerance": ("test_srun_tasks_preempted_then_requeued",),  # SIGUSR1 stays (to the launchers)
    "test_hub": ("test_a_hub_model_and_dataset_train_as_their_directories_do",),  # the README's Hub line stays
    # the planner against the dry run: each objective, ZeRO-3, ZeRO-2 and a pipeline stay in the fast tier
    "test_plan_objectives": tuple(f"test_the_planner_follows_the_dry_run[{row}" for row in (
        "distill tp2", "distill pp2", "dpo ddp", "simpo tp2 sp", "dpo lora zero3")),
    "test_plan_published": ("test_the_planner_follows_the_dry_run[gated delta net selective",
                            "test_the_planner_follows_the_dry_run[gated delta net full",
                            "test_the_planner_follows_the_dry_run[gated delta net context full",
                            "test_the_planner_follows_the_dry_run[gpt_oss eager selective",
                            "test_gemma4_pipeline_stages_follow_the_dry_run",
                            "test_latent_attention_parameters_under_tensor_parallelism"),
    "test_plan_published_context": ("test_the_planner_follows_the_dry_run_at_long_sequences[ring",
                                    "test_the_planner_follows_the_dry_run_at_long_sequences[fewer",
                                    "test_the_planner_follows_the_dry_run_at_long_sequences[experts"),
    # Gemma 4's layer terms under full and selective checkpointing stay; ZeRO-1 and each context-parallel kernel
    "test_plan_gemma4": ("test_gemma4_checkpointing_and_context_parallelism_follow_the_dry_run[cp2",
                         "test_gemma4_checkpointing_and_context_parallelism_follow_the_dry_run[zero1",
                         # its MoE branch: without checkpointing and under full checkpointing stay
                         "test_gemma4_moe_branch_follows_the_dry_run[zero2 selective",
                         "test_gemma4_moe_branch_follows_the_dry_run[zero1",
                         "test_gemma4_moe_branch_follows_the_dry_run[cp2",
                         "test_gemma4_moe_branch_follows_skewed_routing",
                         # the full-attention layers' own shape: without checkpointing and the ring's cache stay
                         "test_gemma4_full_attention_layers_follow_the_dry_run[zero2 ",
                         "test_gemma4_full_attention_layers_follow_the_dry_run[cp2 ring full",
                         "test_gemma4_full_attention_layers_follow_the_dry_run[cp2 allgather"),
    "test_plan_eager_pipeline": ("test_",),  # a tiny gpt-oss in interleaved stages (~12 CPU-s)
    "test_dryrun_cuda_attention": ("test_latent_attention_with_narrow_values_follows_the_planner[full",),
    # the dry run of a tiny Qwen3-Next with transformers' loop and with the stand-in (20-60 s); the rule alone stays
    "test_dryrun_delta_rule": ("test_the_dry_run_peaks_where_transformers_loop_does",),
    # the published models' searches (30 s each; their layer terms stay in test_plan_published)
    "test_published_models": ("test_plan_proposes_a_layout_the_model_takes",),
    # sharded accumulation: the pipeline's count and the planner's rows but ZeRO-3 with offload and checkpointing
    "test_plan_sharded_accumulation": ("test_every_micro_batch_reduce_scatters_and_keeps_no_whole_gradient[pipeline",
                                       *(f"test_the_planner_follows_the_dry_run[{row}" for row in (
                                           "zero3]", "zero2", "pp2 1f1b", "pp2 gpipe")),
                                       "test_attention_after_the_reduced_experts_follows_the_dry_run"),  # ~13 s each
    "test_plan_zero_bubble": ("test_zero_bubble_on_one_shard_per_replica_within_5_percent",),  # test_plan's rows stay
    "test_preference_layouts": ("two_processes",),  # every layout, packed too; one process packed stays
    "test_distill": ("two_processes",),  # distillation under every layout; the hand-written reference stays
    "test_float8": ("two_processes",),  # float8 under every layout; the rule, the plain loop and the resume stay
    "test_int8_states": ("two_processes",),  # 8-bit states under the layouts; the plain loop and the resume stay
    # Ray Train: each run costs Ray's start of a worker group (10-20 s here), each restart another; DDP parity and
    # the refusals stay
    "test_ray": ("test_zero3_through_the_python_entry_point", "test_a_killed_worker_actor", "test_sigterm_to_a_worker_actor",
                 "test_resize_from_two_to_one"),
}


def _slow_tier(item) -> bool:
    keys = SLOW_TIER.get(item.path.stem, ())
    return any(item.name.startswith(k) or k in item.fixturenames for k in keys)


def pytest_collection_modifyitems(items):
    for item in items:
        if _slow_tier(item):
            item.add_marker(pytest.mark.slow)

    def rank(item):
        module = item.path.stem
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a module is kept
