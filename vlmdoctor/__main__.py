from vlmdoctor.cli import main

main()
