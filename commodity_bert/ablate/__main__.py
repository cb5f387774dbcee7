from commodity_bert.ablate.cli import main

main()
