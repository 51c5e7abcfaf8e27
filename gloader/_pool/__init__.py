"""The pool of worker processes, in the shape of `multiprocessing.Pool`, in one room: the
supervised pool and its shutdown ladder (`core`, behind `PoolCore`/`make_core`), what gloader
does with multiprocess's pool and every name of it relied on (`mp`, `mpclasses`), the deaths
of its workers (`deaths`), its directory of files (`directory`), and which workers may take
tasks when it has more than CPUs (`admission`). The caller uses it through `core`; its workers
call the hooks of `mp`.
"""
