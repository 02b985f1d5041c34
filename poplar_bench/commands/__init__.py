"""`poplar-bench`'s commands, one light module each (as accelerate's ``commands/``): `register(subparsers)`,
`run(args)`, which imports the module doing the work only then (``simulate`` never imports torch)."""
