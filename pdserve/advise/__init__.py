"""`pdserve advise` and `pdserve bench serve`: goodput under TTFT and TPOT SLOs at Poisson rates,
colocated against every P:D split, measured on the user's workload, and the advice it gives."""
