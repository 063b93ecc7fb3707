"""A request's output text: detokenization and the stop rules, applied once (pure, torch-free).

The router applies them to every request it serves, and `pdserve.llm` to offline generation;
the engine stops only on token ids, EOS, a finished grammar and max_tokens.
"""
