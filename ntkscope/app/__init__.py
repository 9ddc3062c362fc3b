"""What a person runs: the command line, its commands as library functions, the demo."""
