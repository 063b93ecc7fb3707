"""`pdserve bench engine|transfer|multiturn|gpu-check`: benchmarks that print a table and write
JSON with ratios, each side measured in the same run."""
