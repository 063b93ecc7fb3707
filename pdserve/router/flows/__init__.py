"""How one request runs once it is accepted: the dispatcher picks a flow (colocated or
disaggregated), the flow drives the workers, and the recovery table answers each failure."""
