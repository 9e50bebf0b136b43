"""Communication: the one door to ``torch.distributed`` (``Communicator``), the record of every
collective (``CommLedger``), and the process launcher for tests and benchmarks."""

from poplar.comm.communicator import Communicator
from poplar.comm.pending import CollectiveObserver, PendingChain, PendingCollective
from poplar.comm.ledger import CommLedger, CommRecord, LedgerPosition, Phase
from poplar.types.errors import DistributedError

__all__ = ["Communicator", "CollectiveObserver", "PendingCollective", "PendingChain", "CommLedger", "CommRecord", "LedgerPosition", "Phase",
           "DistributedError"]
