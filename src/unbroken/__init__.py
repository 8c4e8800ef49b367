"""unbroken: a control plane that serves LLMs with zero dropped token streams.

Layers, outermost first (an outer layer may import an inner one, never the reverse):

    cli                      thin typer front end
    pipeline                 local supervisor (`unbroken up`), talks HTTP to the rest
    engine, gateway          one process each; never import each other
    wire, config             wire types, SSE codec, errors, HTTP helpers, the pipeline spec
"""

__version__ = "0.1.0"
