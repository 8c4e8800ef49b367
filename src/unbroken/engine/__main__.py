"""`python -m unbroken.engine`: the simulator with vLLM's flag syntax (`cli_args.py`)."""

from unbroken.engine.cli_args import main

main()
