"""Models that ship with poplar-ext, for the demo, the examples, the tests and `poplar-profile`.

`toy_gpt`: a small GPT and a synthetic token data set (nothing is downloaded). Not
part of the runtime: poplar-ext trains whatever model the user gives it.
"""
