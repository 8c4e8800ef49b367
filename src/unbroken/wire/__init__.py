"""Wire layer: what every component speaks. OpenAI request models and error bodies, the
SSE codec, and small aiohttp helpers. Imports nothing else from unbroken."""
