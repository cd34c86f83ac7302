"""empo2: EMPO² and GRPO for LLM agents. Importing the package registers the config resolvers."""
from src.utils.resolvers import register_resolvers

register_resolvers()
