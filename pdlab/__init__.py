"""pdlab: the test and fault tooling beside pdserve. Benchmarks (`pdserve bench`), fault
scenarios and soaks under a seeded nemesis (`pdserve chaos`), network namespaces.

It imports pdserve; pdserve never imports it. Its commands reach `pdserve` through the
`pdserve.commands` entry points.
"""
