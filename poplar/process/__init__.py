"""A process's life in a distributed job: how ranks start, how long they wait, how they end.

- ``launch``: ``spawn`` runs a function on N local ranks joined by a process group (the demo's
  emulated cluster, the multi-process tests and benches), never hanging;
- ``timeouts``: the collective timeout every door uses, and setting it on a group made elsewhere;
- ``attempts``: a fresh rendezvous namespace for each torchrun attempt, so a restarted group re-forms;
- ``failure``: one failure line per job, naming the ranks that failed or did not report;
- ``sigterm_watch``: a rank blocked in a collective still answers SIGTERM;
- ``launcher_watch``: workers never outlive their launcher;
- ``group_exit``: the process group ends while the interpreter still runs.

These modules use torch.distributed and the standard library only: the communicator
(``poplar.comm``) sits above them and reads ``sigterm_watch.BLOCKED`` around its waits."""
