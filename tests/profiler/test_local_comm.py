"""The pretend world of the capacity search (``profiler/local_comm.py``) talks to no process."""

from poplar.profiler.local_comm import LocalCommunicator


def test_a_plan_that_leaves_ranks_out_makes_no_process_group_in_a_pretend_world():
    # a trial of a plan with a rank left out must not call dist.new_group: that is a collective
    # over the real world which only the trying rank would join (it waited for ever)
    comm = LocalCommunicator(4, 1)
    comm.set_step_ranks([0, 1, 3])
    assert comm.step_group is None and comm.in_step
