from ckpt_plugin_integrations.llama_cpp_server.cli import main

main()
