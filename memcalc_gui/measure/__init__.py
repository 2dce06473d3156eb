"""memcalc_gui.measure"""
