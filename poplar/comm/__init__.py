"""Communication: the one door to ``torch.distributed`` (``Communicator``) and the record of every
collective (``CommLedger``). How ranks start, wait and end is ``poplar.process``."""

from poplar.comm.communicator import Communicator
from poplar.comm.pending import CollectiveObserver, PendingChain, PendingCollective
from poplar.comm.ledger import CommLedger, CommRecord, LedgerPosition, Phase
from poplar.types.errors import DistributedError

__all__ = ["Communicator", "CollectiveObserver", "PendingCollective", "PendingChain", "CommLedger", "CommRecord", "LedgerPosition", "Phase",
           "DistributedError"]
