"""WebShop: a faithful re-implementation of the original text environment (SPEC §3.2, WEBSHOP.md)."""
from src.envs.webshop.env import WebShopEnv, WebShopTextEnv

__all__ = ["WebShopEnv", "WebShopTextEnv"]
