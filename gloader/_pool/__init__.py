"""The pool of worker processes, in the shape of `multiprocessing.Pool`, in one room: the
supervised pool and its shutdown ladder (`core`, behind `PoolCore`/`make_core`), gloader's own
process and thread pools (`processes`), the wire between the caller and the workers and the
workers' loop (`channel`), the deaths of workers (`deaths`), the pool's directory of files
(`directory`), and which workers may take tasks when it has more than CPUs (`admission`). The
caller uses it through `core`; its workers run `channel.worker_main`.
"""
