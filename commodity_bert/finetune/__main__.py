from commodity_bert.finetune.cli import main

main()
