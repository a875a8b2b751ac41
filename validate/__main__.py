from validate.cli import main

main()
