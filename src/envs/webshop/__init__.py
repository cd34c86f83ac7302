"""WebShop: a faithful re-implementation of the original text environment (docs/environments.md#webshop; the original:
https://github.com/princeton-nlp/WebShop)."""
from src.envs.webshop.env import WebShopEnv, WebShopTextEnv

__all__ = ["WebShopEnv", "WebShopTextEnv"]
