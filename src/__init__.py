"""empo2: EMPO² and GRPO for LLM agents. Importing the package registers the config resolvers and the config
groups' schemas."""
from src.config_schema import register_schemas
from src.utils.resolvers import register_resolvers

register_resolvers()
register_schemas()
