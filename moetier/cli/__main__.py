from moetier.cli import main

main()
