"""Planning a GPU job before it runs: the full-scale rehearsal on a CPU (``dapo rehearse``)."""
