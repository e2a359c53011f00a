"""Resume checks without a process group: the data-stream identity, where a changed stream
restarts, and which checkpoints load at which layout (megatron/stream/data_identity.py,
megatron/checkpoint/checkpoint_check.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_omnibal.balance.config import BalanceConfig, Level, PackCost
from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.megatron.checkpoint.checkpoint_check import (
    SavedRun,
    check_layout,
    plan_resume,
)
from megatron_omnibal.megatron.flags.args import OmnibalArgsError
from megatron_omnibal.megatron.stages.layout import layout_from_counts
from megatron_omnibal.megatron.stream.data_identity import (
    StreamIdentity,
    StreamOrigin,
    lengths_digest,
    restarted_origin,
)

rng = np.random.default_rng(3)
LENGTHS = from_arrays(rng.integers(0, 6, 50), rng.integers(20, 200, 50) + 300)
BALANCE = dict(vit_budget=16, token_budget=160, seed=7, dp_size=2, micro_batches=4)


def identity(lengths=LENGTHS, text_scale=1, data="synthetic", **changes):
    balance = BalanceConfig(**{**BALANCE, **changes})
    return StreamIdentity.of(lengths, text_scale=text_scale, data=data, balance=balance)


def test_identity_is_the_same_for_the_same_inputs_and_survives_a_round_trip():
    assert identity() == identity()
    assert StreamIdentity.from_dict(identity().to_dict()) == identity()
    assert identity().differences(identity()) == []


@pytest.mark.parametrize(
    "change, field, saved, now",
    [
        ({"vit_budget": 24}, "vit_budget", 16, 24),
        ({"token_budget": 200}, "token_budget", 160, 200),
        ({"seed": 8}, "seed", 7, 8),
        ({"dp_size": 4}, "dp_size", 2, 4),
        ({"micro_batches": 8}, "micro_batches", 4, 8),
        ({"mode": "grouped"}, "mode", "random", "grouped"),
        ({"algorithm": "isf"}, "algorithm", "default", "isf"),
        ({"oversize": "solo"}, "oversize", "error", "solo"),
        ({"cost": PackCost.parse("1,2,0")}, "cost", "null",
         '{"attention_ms":[0.0],"tile_ms":[1.0],"token_ms":[2.0]}'),
        ({"tail_tolerance": 0.1}, "tail_tolerance", 0.015, 0.1),
        ({"levels": (Level(vit_budget=8, token_budget=80, micro_batches=4),
                     Level(vit_budget=16, token_budget=160, micro_batches=4))}, "levels", "[]",
         None),
        ({"text_scale": 4}, "text_scale", 1, 4),
        ({"data": "/data/meta.json"}, "source", "synthetic", "dataset"),
    ],
)
def test_every_input_of_the_stream_is_part_of_its_identity(change, field, saved, now):
    (diff,) = identity().differences(identity(**change))
    assert diff[:2] == (field, saved) and (now is None or diff[2] == now)


def test_one_changed_record_changes_the_lengths_digest():
    tokens = LENGTHS.tokens.copy()
    tokens[17] += 1
    changed = from_arrays(LENGTHS.vit, tokens, LENGTHS.image_flags)
    assert lengths_digest(changed) != lengths_digest(LENGTHS)
    assert [d[0] for d in identity().differences(identity(changed))] == ["lengths_sha256"]
    shorter = LENGTHS.subset(np.arange(49))
    fields = [d[0] for d in identity().differences(identity(shorter))]
    assert fields == ["lengths_sha256", "num_samples"]


def test_an_identity_from_another_version_without_a_field_is_an_error():
    d = identity().to_dict()
    del d["seed"]
    with pytest.raises(ValueError, match="lacks seed"):
        StreamIdentity.from_dict(d)
    assert StreamIdentity.from_dict({**identity().to_dict(), "unknown": [2, 4]}) == identity()


@pytest.mark.parametrize("consumed, epoch", [(0, 0), (1, 1), (50, 1), (51, 2), (149, 3)])
def test_a_restarted_stream_begins_the_epoch_after_the_passes_already_made(consumed, epoch):
    assert restarted_origin(9, consumed, 50) == StreamOrigin(
        iteration=9, epoch=epoch, consumed_samples=consumed
    )


def saved_run(fmt="torch_dist", tp=1, vit=(4, 0), llm=(1, 3), stream=None, origin=None, it=6):
    layouts = layout_from_counts(vit, llm, None, None, 4, 4)
    info = {"layouts": [st.to_dict() for st in layouts],
            "stream": (stream or identity()).to_dict()}  # fmt: skip
    if origin is not None:
        info["origin"] = origin.to_dict()
    return SavedRun(path="ckpt/iter", iteration=it, format=fmt, tp=tp, pp=len(vit),
                    consumed_samples=123, vocab_size=128, info=info)  # fmt: skip


def resume(saved, current=None, allow=False, finetune=False):
    return plan_resume(saved, current or identity(), allow_data_change=allow, finetune=finetune,
                       load="ckpt", lengths_file="now.json")  # fmt: skip


def test_the_same_stream_resumes_at_the_checkpoint_origin():
    origin = StreamOrigin(iteration=3, epoch=2, consumed_samples=77)
    plan = resume(saved_run(origin=origin))
    assert (plan.origin, plan.start_iteration, plan.notes) == (origin, 6, ())
    assert resume(saved_run()).origin == StreamOrigin()
    assert resume(None).start_iteration == 0


def test_another_stream_is_refused_naming_both_values():
    with pytest.raises(OmnibalArgsError) as err:
        resume(saved_run(), identity(token_budget=200, seed=8))
    text = str(err.value)
    assert "--load ckpt: iteration 6 was trained on another data stream" in text
    assert "token_budget: checkpoint 160, this run 200" in text
    assert "seed: checkpoint 7, this run 8" in text
    assert "--omnibal-allow-data-change" in text and "123 consumed samples" in text


def test_a_stream_of_an_older_packer_is_refused():
    older = dataclasses.replace(identity(), packer_version=identity().packer_version - 1)
    with pytest.raises(OmnibalArgsError, match="packer_version: checkpoint"):
        resume(saved_run(stream=older))


def test_another_length_file_is_named_with_both_paths():
    other = LENGTHS.subset(np.arange(1, 50))
    with pytest.raises(OmnibalArgsError, match="lengths: checkpoint .* this run now.json"):
        resume(saved_run(), identity(other))


def test_an_allowed_change_starts_a_new_epoch_plan_and_says_so():
    plan = resume(saved_run(), identity(token_budget=200), allow=True)
    assert plan.origin == StreamOrigin(iteration=6, epoch=3, consumed_samples=123)
    assert len(plan.notes) == 1
    assert "iteration 7 starts epoch 3 of a new balanced plan" in plan.notes[0]
    assert "token_budget: checkpoint 160, this run 200" in plan.notes[0]


def test_finetuning_and_unrecorded_checkpoints_start_their_own_stream():
    plan = resume(saved_run(), identity(seed=1), finetune=True)
    assert (plan.origin, plan.start_iteration) == (StreamOrigin(), 0)
    bare = dataclasses.replace(saved_run(), info=None)
    plan = resume(bare)
    assert plan.origin == StreamOrigin() and plan.start_iteration == 6
    assert "records no data-stream identity" in plan.notes[0]


def layouts(vit, llm, vit_rc=None, llm_rc=None):
    return tuple(layout_from_counts(vit, llm, vit_rc, llm_rc, 4, 4))


def test_a_torch_checkpoint_loads_only_at_its_own_split():
    saved = saved_run("torch")
    check_layout(saved, layouts((4, 0), (1, 3), llm_rc=(0, 2)), 1, "ckpt", 128)  # recompute only
    with pytest.raises(OmnibalArgsError) as err:
        check_layout(saved, layouts((2, 2, 0, 0), (0, 0, 2, 2)), 1, "ckpt", 128)
    assert ("is a 'torch' checkpoint saved at TP=1, PP=2 (ViT layers 4+0, LLM layers 1+3); "
            "this run has TP=1, PP=4 (ViT layers 2+2+0+0, LLM layers 0+0+2+2)") in str(err.value)
    with pytest.raises(OmnibalArgsError, match="PP=2 \\(ViT layers 4\\+0, LLM layers 2\\+2\\)"):
        check_layout(saved, layouts((4, 0), (2, 2)), 1, "ckpt", 128)
    with pytest.raises(OmnibalArgsError, match="saved at TP=1, PP=2 .* this run has TP=2"):
        check_layout(saved, layouts((4, 0), (1, 3)), 2, "ckpt", 256)


def test_a_torch_dist_checkpoint_loads_at_any_split_unless_the_vocabulary_pads_differently():
    saved = saved_run("torch_dist")
    check_layout(saved, layouts((2, 2, 0, 0), (0, 0, 2, 2)), 1, "ckpt", 128)
    with pytest.raises(OmnibalArgsError, match="pads its vocabulary of 128 to 128 rows; at TP=2"):
        check_layout(saved, layouts((4, 0), (1, 3)), 2, "ckpt", 128)
    wide = dataclasses.replace(saved, vocab_size=256)
    check_layout(wide, layouts((4, 0), (1, 3)), 2, "ckpt", 256)
    # a ViT of 3 heads: 3 at TP=1, padded to 4 at TP=2 and TP=4: TP 2 <-> 4 reshards
    with pytest.raises(OmnibalArgsError, match="3 attention heads are padded to 3; at TP=2"):
        check_layout(wide, layouts((4, 0), (1, 3)), 2, "ckpt", 256, vit_heads=3)
    at_tp2 = dataclasses.replace(saved, tp=2, vocab_size=512)
    check_layout(at_tp2, layouts((4, 0), (1, 3)), 4, "ckpt", 512, vit_heads=3)


def test_a_bad_tracker_file_or_a_missing_iteration_is_refused(tmp_path):
    from megatron_omnibal.megatron.checkpoint.checkpoint_check import read_saved_run
    from megatron_omnibal.megatron.runtime.compat import ensure_typing_override

    ensure_typing_override()  # megatron.training on Python 3.11
    args = {"load": str(tmp_path), "ckpt_step": None}
    assert read_saved_run(**args) is None  # nothing saved yet: Megatron starts from scratch
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("seven\n")
    with pytest.raises(OmnibalArgsError, match="holds 'seven', expected an iteration number"):
        read_saved_run(**args)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(OmnibalArgsError, match="no checkpoint directory .*iter_0000007"):
        read_saved_run(**args)
    (tmp_path / "iter_0000007").mkdir()
    with pytest.raises(OmnibalArgsError, match="holds neither a torch_dist checkpoint"):
        read_saved_run(**args)


def test_an_identity_from_another_version_needs_permission_to_resume():
    saved = saved_run()
    info = {**saved.info, "stream": {"seed": 7}}
    other = dataclasses.replace(saved, info=info)
    with pytest.raises(OmnibalArgsError, match="another data stream: its data-stream identity "
                                               "lacks lengths_sha256"):  # fmt: skip
        resume(other)
    plan = resume(other, allow=True)
    assert plan.origin == StreamOrigin(iteration=6, epoch=3, consumed_samples=123)
