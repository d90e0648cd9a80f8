"""Host integrations of ckpt_plugin, one package per host, installed as ``ckpt_plugin_integrations``."""
