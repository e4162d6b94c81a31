"""Running a whole job: the train loop, checkpoints, metrics, and (later) Ray placement."""
