"""The neutral base every layer may import: the artifact store behind every cache, machine facts, error text and
the pydantic-to-argparse flags. It imports nothing of glowplug's but `profiling`'s names and tracing."""
