"""What runs where batches are loaded (a worker process, a thread, or the caller's thread for
`num_workers=0`): the entry points and the task function (`run`), the loaders each worker
serves (`registry`), fetching and batching (`fetch`, `rows`), writing batches into the slots it
is lent (`slots`), torch DataPipes as torch's loader runs them (`datapipes`) and a worker
process's own setup (`setup`). Nothing here imports what runs
only in the caller (`gloader._caller`, the strategies of `gloader._places`, `loader`).
"""
