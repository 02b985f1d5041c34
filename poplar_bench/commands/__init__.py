"""The commands of `poplar-bench`, one module each: `register(subparsers)` adds its parser, `run(args)` runs it.

As in accelerate's ``commands/``: each module is light (argparse and the plan formats); the module doing
the work is imported only when its command runs, so ``simulate`` never imports torch.
"""
