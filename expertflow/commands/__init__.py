"""Sub-commands of the `expertflow` command line, one module each; each exposes `register(subparsers)`."""
