"""Training math and the worker process (arrives with the NoLoCo issue); never imports protocol/."""
