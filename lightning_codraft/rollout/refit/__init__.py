"""The refit's one home: bucketed, versioned weight streams from the training state to any engine
(``buckets``), and the sync that sends them (``sync``)."""
