"""What runs in the caller's process: the loader's checked settings and torch's attributes
(`options`, `attributes`), the epochs it serves and where it stands (`serving`), the window of
tasks in flight and their batches in order (`engine`, `task`, `sizing`), the workers over the
loader's life and their tuned count (`workers`, `tuning`), the iterator the user holds with its
pin thread and device stage (`iterator`, `device`), the shared-memory slots it lends and takes
back (`slots`, `dropped`), what it ships to the workers (`payload`), and what it measures
(`stats`, `snapshot`). Nothing here runs in a worker; the whole flow is drawn in `engine`.
"""
