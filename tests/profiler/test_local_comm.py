"""The pretend world of the capacity search (``profiler/local_comm.py``) talks to no process."""

from poplar.comm.routes import PretendWorld
from poplar.profiler.local_comm import LocalCommunicator
from poplar.types.route import Collectives, Route


def test_a_plan_that_leaves_ranks_out_makes_no_process_group_in_a_pretend_world():
    # a trial of a plan with a rank left out must not call dist.new_group: that is a collective
    # over the real world which only the trying rank would join (it waited for ever)
    comm = LocalCommunicator(4, 1)
    routes = comm.configure(Route((0, 1, 3), Collectives.SECONDARY_SHARDS))
    assert isinstance(routes.step, PretendWorld) and routes.step is routes.world and comm.in_step
    assert not routes.keeps_secondary and comm.secondary_numel([4, 4, 0, 4], 4, 4) == 0
