from dpserve.daemons.cli.main import main

main()
