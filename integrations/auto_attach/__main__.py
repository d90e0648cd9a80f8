from ckpt_plugin_integrations.auto_attach.cli import main

main()
