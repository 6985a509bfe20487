from mac_moesd.cli import main

main()
