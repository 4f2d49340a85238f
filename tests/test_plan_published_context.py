"""The planner against the dry run on the terms that decide gpt-oss's plans at long sequences, each on a tiny gpt-oss
whose memory that term dominates (one simulated rank, in this process, a few seconds each):
- under sequence parallelism every tensor-parallel rank routes all of its tokens through the whole experts (the MoE
  block's input is gathered from the sequence shards), not its shard of them;
- under ring attention with selective checkpointing a sliding-window layer caches the kernel outputs of the blocks
  its window reaches only, over the rows that reach them, not a full-attention layer's cp blocks;
- with fewer experts than ranks sharing them, each expert tensor is split along its rows (FSDP2's own split, on
  the experts, would leave whole experts on the first ranks and nothing on the last): an even share;
- without checkpointing every layer keeps its RMSNorms' fp32 input and fp32 normalised tensor (gpt-oss's weight
  multiplies the latter), and the ring's backward ends with the sinks' gradient (three query-sized fp32 tensors)
  while the ring's forward, run before the layer's MLP has saved anything, is not the fullest moment;
- the chunked loss head holds one chunk's logits in the compute dtype beside its fp32 statistics, not the previous
  chunk's gradient too (gpt-oss's 201,088-token vocabulary: 0.77 GiB a chunk of 2,048 tokens)."""

from __future__ import annotations

import pytest

from hf_models import family_config

# tiny gpt-oss shapes (over the family's tiny config) and the run's overrides; each within 5% of the dry run's peak
CASES = {
    # the experts' tensors dominate: 256-wide experts, every token to all 4
    "experts under sequence parallelism": (
        2, 0, dict(intermediate_size=256, num_experts_per_tok=4, max_position_embeddings=512),
        ("data.seq_len=512", "train.global_batch_size=1", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=2",
         "parallel.activation_checkpointing=selective")),
    # the ring's cached block outputs dominate (16 heads over a 64-wide model): the last context rank, whose
    # full-attention layers cache the most blocks; half the layers slide over 8 tokens
    "ring blocks of sliding layers": (
        4, 3, dict(num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=2048),
        ("data.seq_len=2048", "train.global_batch_size=1", "parallel.cp=4", "parallel.zero_stage=3", "parallel.activation_checkpointing=selective")),
    # 2 experts over ep=2 leave one a rank, and 2 ranks share it (dp_shard x cp / ep): half of its rows each
    "fewer experts than the ranks sharing them": (
        4, 0, dict(num_local_experts=2, intermediate_size=256, max_position_embeddings=512),
        ("data.seq_len=256", "train.global_batch_size=2", "parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=3")),
    # gpt-oss-20b's 131,072-token layout in small: ZeRO-2 over dp=2, experts over 4 ranks borrowing context ranks,
    # the ring over 4, no checkpointing: the saved norms and the ring's backward decide the peak (7.5% under before)
    "no checkpointing under the ring": (
        8, 0, dict(num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=2048),
        ("data.seq_len=2048", "train.global_batch_size=2", "parallel.cp=4", "parallel.ep=4", "parallel.zero_stage=2",
         "parallel.activation_checkpointing=none")),
    # the same with a vocabulary large enough for the loss head's chunks to decide the peak (9.7% under before)
    "loss chunks beside a large vocabulary": (
        8, 0, dict(num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=2048, vocab_size=16384),
        ("data.seq_len=2048", "train.global_batch_size=2", "parallel.cp=4", "parallel.ep=4", "parallel.zero_stage=2",
         "parallel.activation_checkpointing=none", "train.loss_chunk_tokens=256")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_planner_follows_the_dry_run_at_long_sequences(name, tmp_path):
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config

    world, rank, shape, overrides = CASES[name]
    config = family_config("gpt_oss")
    for key, value in shape.items():
        setattr(config, key, value)
    config.save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.hf={tmp_path}", "precision.compute_dtype=bf16", "train.micro_batch_size=1",
                             *overrides])
    run = dry_run(cfg, world, [rank])["ranks"][0]
    detail = (name, run["error"], run["bytes"], run["planner"])
    assert abs(run["error"]["peak_bytes"]) <= 0.05, detail
    for category in ("parameters", "optimizer"):
        assert abs(run["error"][category]) <= 0.005, detail
