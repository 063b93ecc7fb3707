"""Where a request runs: worker selection by prefix affinity, session affinity and load, over the
router's prefix index. Pure."""
