"""Where engine cores and model ranks run besides this thread: tensor-parallel workers, a core in a
child process, data-parallel replicas."""
