"""Auto mode's lossy options: ``AutoOptions(compression=...)`` is planned as given, on the stages
it admits (a stage given that it does not admit is one clear error); ``allow_lossy`` reaches the
planner's choice; neither (the default) plans exact collectives; the log line says which."""

from __future__ import annotations

import pytest
import torch

from poplar.auto import AutoOptions
from poplar.auto.mode import lossy_line, lossy_stages
from poplar.engine import PoplarEngine
from poplar.planner import plan
from poplar.types.compression import CommPolicy
from poplar.types.profiles import ProfileError
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks
from tests.planner.test_link_pricing import SLOW, profile, two_nodes

ALL = (0, 1, 2, 3)


def test_a_given_policy_narrows_the_stages_auto_mode_chooses_among() -> None:
    assert lossy_stages(AutoOptions(), ALL, None) == (ALL, None)
    assert lossy_stages(AutoOptions(compression=CommPolicy(weights="int8")), ALL, None) == ((3,), None)
    assert lossy_stages(AutoOptions(compression=CommPolicy(gradients="int8")), ALL, None) == ((2, 3), None)
    assert lossy_stages(AutoOptions(compression=CommPolicy()), (1,), None) == ((1,), None)  # exact: any stage
    _, error = lossy_stages(AutoOptions(compression=CommPolicy(gradients="int8")), (1,), None)
    assert "use zero_stage=2 or 3, or gradients='none'" in error
    assert "must be True or False" in lossy_stages(AutoOptions(allow_lossy="yes"), ALL, None)[1]
    assert "must be a poplar CommPolicy" in lossy_stages(AutoOptions(compression="int8"), ALL, None)[1]


def test_the_engine_refuses_a_policy_its_stage_cannot_run_before_profiling() -> None:
    model = create_model("llama-tiny", seed=0, max_seq_len=16)
    with pytest.raises(ProfileError, match="quantize ZeRO-3's parameter gathers, but the stage is ZeRO-2"):
        PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=2, global_batch_size=4,
                     loss_fn=llama_loss_fn, auto=AutoOptions(profile_data=TextBlocks(seq_len=16), store=None,
                                                             compression=CommPolicy(weights="int8")))


def test_the_planner_gets_what_the_options_say_and_the_log_line_says_it() -> None:
    prof = profile(two_nodes(cross=SLOW), stage=3)
    # one micro-step a rank (at more, crossing once per iteration exact beats quantizing each crossing)
    exact = plan(prof, 200, 3, collectives=AutoOptions().collectives_request)
    assert not exact.compression.lossy and exact.choice.compression_choice is None
    chosen = plan(prof, 200, 3, collectives=AutoOptions(allow_lossy=True).collectives_request)
    assert chosen.compression.lossy
    assert lossy_line(chosen).startswith(f"auto mode: {chosen.compression.describe()} chosen (allow_lossy): predicted")
    given = plan(prof, 1000, 3, collectives=AutoOptions(compression=CommPolicy(gradients="int8"),
                                                        collectives="flat").collectives_request)
    assert given.compression == CommPolicy(gradients="int8") and not given.hierarchical
    assert "(as given): the step is no longer exactly the global batch's" in lossy_line(given)
